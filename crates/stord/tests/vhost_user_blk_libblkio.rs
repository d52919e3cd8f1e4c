//! The vhost-user-blk export driven by libblkio (the `blkio` crate, driver
//! `virtio-blk-vhost-user`): the client behind QEMU's `virtio-blk-vhost-user` blockdev,
//! fio's libblkio engine and nbdkit's blkio plugin. It needs the CONFIGURE_MEM_SLOTS
//! protocol feature (its buffers are added as memory regions at run time). Each test runs
//! against stord and, to show it is fair, against qemu-storage-daemon.

mod common;

use std::mem::MaybeUninit;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use blkio::{Blkio, Blkioq, Completion, MemoryRegion, ReqFlags};
use common::rawqmp::{monitor_args, RawQmp};
use common::{tmpdir, Stord};

const IMAGE: u64 = 64 << 20;
/// Bytes each queue writes and reads back.
const SPAN: usize = 1 << 20;
const BS: usize = 64 << 10;

enum Peer {
    Stord(Stord),
    Qsd(Child),
}

impl Peer {
    /// Starts a daemon exporting `img` on `sock` (`export` appended to the export options).
    fn start(
        qsd: bool,
        dir: &Path,
        img: &Path,
        sock: &Path,
        export: &str,
        iothreads: usize,
    ) -> Peer {
        let mut args: Vec<String> = Vec::new();
        for i in 0..iothreads {
            args.extend(["--object".into(), format!("iothread,id=io{i}")]);
        }
        args.extend([
            "--blockdev".into(),
            format!(
                "driver=file,node-name=disk,filename={},cache.direct=on,aio=io_uring",
                img.display()
            ),
            "--export".into(),
            format!(
                "type=vhost-user-blk,id=vu0,node-name=disk,addr.type=unix,addr.path={}{export}",
                sock.display()
            ),
        ]);
        if !qsd {
            args.extend(monitor_args(&dir.join("qmp.sock")));
            return Peer::Stord(Stord::start(dir, &args));
        }
        let child = Command::new("qemu-storage-daemon")
            .args(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn qemu-storage-daemon");
        let t = Instant::now();
        while !sock.exists() {
            assert!(t.elapsed() < Duration::from_secs(10), "qsd did not listen");
            std::thread::sleep(Duration::from_millis(10));
        }
        Peer::Qsd(child)
    }

    /// Stops it; stord's stderr (its exit statistics), empty for qsd.
    fn stop(self) -> String {
        match self {
            Peer::Stord(mut s) => s.stop_and_stderr(),
            Peer::Qsd(mut c) => {
                // SAFETY: kill(2) on our own child's pid.
                unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
                let _ = c.wait();
                String::new()
            }
        }
    }
}

/// A started libblkio instance with one memory region of `queues * SPAN` bytes.
struct Client {
    blkio: Blkio,
    queues: Vec<Blkioq>,
    region: MemoryRegion,
}

fn connect(sock: &Path, queues: i32, poll: bool) -> Client {
    let msg = |what: &str, e: blkio::Error| format!("libblkio {what}: {}", e.message());
    let mut b = Blkio::new("virtio-blk-vhost-user").unwrap();
    b.set_str("path", &sock.display().to_string()).unwrap();
    b.connect()
        .unwrap_or_else(|e| panic!("{}", msg("connect", e)));
    let key = if poll {
        "num-poll-queues"
    } else {
        "num-queues"
    };
    b.set_i32(key, queues).unwrap();
    if poll {
        b.set_i32("num-queues", 0).unwrap();
    }
    let started = b.start().unwrap_or_else(|e| panic!("{}", msg("start", e)));
    let qs = if poll {
        started.poll_queues
    } else {
        started.queues
    };
    assert_eq!(qs.len(), queues as usize);
    let region = b.alloc_mem_region(queues as usize * SPAN).unwrap();
    b.map_mem_region(&region)
        .unwrap_or_else(|e| panic!("{}", msg("map_mem_region", e)));
    Client {
        blkio: b,
        queues: qs,
        region,
    }
}

/// Runs one request on `q` and waits for it; the completion's return value.
fn one(q: &mut Blkioq, write: bool, offset: u64, buf: usize, len: usize) -> i32 {
    if write {
        q.write(offset, buf as *const u8, len, 7, ReqFlags::empty());
    } else {
        q.read(offset, buf as *mut u8, len, 7, ReqFlags::empty());
    }
    let mut c: [MaybeUninit<Completion>; 1] = [MaybeUninit::uninit()];
    let n = q.do_io(&mut c, 1, None, None).expect("do_io");
    assert_eq!(n, 1);
    // SAFETY: do_io initialised the first `n` (= 1) completions.
    let c = unsafe { c[0].assume_init_read() };
    assert_eq!(c.user_data, 7);
    c.ret
}

/// The pattern queue `i` writes at byte `j` of its span.
fn pattern(i: usize, j: usize) -> u8 {
    (j.wrapping_mul(31) ^ (i * 0x5b) ^ (j >> 9)) as u8
}

/// Each queue (on its own thread) writes SPAN bytes of its pattern at its own offset in
/// 64 KiB requests, clears its buffer, reads them back and compares. Returns per-queue
/// (offset, bytes) for checking the image.
fn write_and_verify(c: &mut Client) -> Vec<(u64, Vec<u8>)> {
    let base = c.region.addr;
    std::thread::scope(|s| {
        let handles: Vec<_> = c
            .queues
            .iter_mut()
            .enumerate()
            .map(|(i, q)| {
                s.spawn(move || {
                    let buf = base + i * SPAN;
                    // SAFETY: the region is mapped for queues * SPAN bytes and stays mapped
                    // while the Blkio lives (past this scope); each thread touches only its
                    // own SPAN, and only while no request of its queue uses it.
                    let mem = unsafe { std::slice::from_raw_parts_mut(buf as *mut u8, SPAN) };
                    for (j, b) in mem.iter_mut().enumerate() {
                        *b = pattern(i, j);
                    }
                    let offset = (i as u64 + 1) * 8 * SPAN as u64;
                    for k in (0..SPAN).step_by(BS) {
                        assert_eq!(one(q, true, offset + k as u64, buf + k, BS), 0);
                    }
                    // SAFETY: as above; no request is in flight now.
                    let mem = unsafe { std::slice::from_raw_parts_mut(buf as *mut u8, SPAN) };
                    mem.fill(0);
                    for k in (0..SPAN).step_by(BS) {
                        assert_eq!(one(q, false, offset + k as u64, buf + k, BS), 0);
                    }
                    // SAFETY: as above.
                    let mem = unsafe { std::slice::from_raw_parts(buf as *const u8, SPAN) };
                    let bad = (0..SPAN).find(|&j| mem[j] != pattern(i, j));
                    assert_eq!(bad, None, "queue {i}: read back differs");
                    (offset, mem.to_vec())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn round_trip(qsd: bool, queues: i32, poll: bool) {
    let who = if qsd { "qsd" } else { "stord" };
    let dir = tmpdir(&format!("blkio-{who}-{queues}-{poll}"));
    let img = dir.join("disk.img");
    std::fs::File::create(&img).unwrap().set_len(IMAGE).unwrap();
    let sock = dir.join("vhost.sock");
    // qsd 10.0 takes one iothread per export (lists arrived in 10.1).
    let (export, iothreads) = match (qsd, queues) {
        (true, n) => (format!(",writable=on,num-queues={n},iothread=io0"), 1),
        (false, 1) => (",writable=on,iothread=io0".to_string(), 1),
        (false, n) => (
            format!(",writable=on,num-queues={n},iothread.0=io0,iothread.1=io1"),
            2,
        ),
    };
    let peer = Peer::start(qsd, &dir, &img, &sock, &export, iothreads);
    let mut c = connect(&sock, queues, poll);
    assert_eq!(c.blkio.get_u64("capacity").unwrap(), IMAGE, "{who}");
    let written = write_and_verify(&mut c);
    drop(c);
    let per_queue = match &peer {
        Peer::Stord(s) => RawQmp::connect(&s.dir.join("qmp.sock")).queue_requests("vu0"),
        Peer::Qsd(_) => Vec::new(),
    };
    peer.stop();
    let image = std::fs::read(&img).unwrap();
    for (offset, data) in written {
        let at = offset as usize;
        assert!(
            image[at..at + SPAN] == data[..],
            "{who}: the image does not hold what queue at {offset} wrote"
        );
    }
    if !qsd {
        assert_eq!(per_queue.len(), queues as usize);
        let each = 2 * (SPAN / BS) as u64;
        assert!(per_queue.iter().all(|&n| n >= each), "{per_queue:?}");
    }
}

#[test]
fn libblkio_round_trips_data_through_one_queue() {
    round_trip(false, 1, false);
}

#[test]
fn libblkio_round_trips_data_through_two_queues_on_two_iothreads() {
    round_trip(false, 2, false);
}

#[test]
fn libblkio_poll_queues_round_trip_data() {
    round_trip(false, 1, true);
}

#[test]
fn libblkio_round_trips_data_with_qsd_too() {
    round_trip(true, 2, false);
}

/// block_resize of the node behind the export while a libblkio client is connected: the
/// client sees the new capacity (libblkio reads it from the config space each time it is
/// asked, and the config space follows the node) and writes past the old end. stord only:
/// qemu-storage-daemon 10.0 does not answer block_resize while a libblkio client is
/// connected to the export (its config-change notice waits for the client).
#[test]
fn libblkio_sees_the_export_grow_after_block_resize() {
    let dir = tmpdir("blkio-resize");
    let img = dir.join("disk.img");
    std::fs::File::create(&img).unwrap().set_len(IMAGE).unwrap();
    let sock = dir.join("vhost.sock");
    let peer = Peer::start(false, &dir, &img, &sock, ",writable=on,iothread=io0", 1);
    let mut c = connect(&sock, 1, false);
    assert_eq!(c.blkio.get_u64("capacity").unwrap(), IMAGE);
    let mut q = RawQmp::connect(&dir.join("qmp.sock"));
    let r = q.send(&format!(
        r#"{{"execute":"block_resize","arguments":{{"node-name":"disk","size":{}}}}}"#,
        2 * IMAGE
    ));
    assert!(r.get("return").is_some(), "{r}");
    assert_eq!(c.blkio.get_u64("capacity").unwrap(), 2 * IMAGE);
    // SAFETY: the region is mapped for SPAN bytes while `c` lives; no request is in flight.
    unsafe { std::ptr::write_bytes(c.region.addr as *mut u8, 0x7e, 4096) };
    let at = IMAGE + 4096;
    assert_eq!(one(&mut c.queues[0], true, at, c.region.addr, 4096), 0);
    drop(c);
    peer.stop();
    let image = std::fs::read(&img).unwrap();
    assert_eq!(image.len() as u64, 2 * IMAGE);
    assert!(image[at as usize..at as usize + 4096]
        .iter()
        .all(|&b| b == 0x7e));
}

#[test]
fn libblkio_sees_a_read_only_export_as_read_only() {
    let dir = tmpdir("blkio-ro");
    let img = dir.join("disk.img");
    std::fs::write(&img, vec![0x3c; 1 << 20]).unwrap();
    let sock = dir.join("vhost.sock");
    let peer = Peer::start(false, &dir, &img, &sock, "", 0);
    // Asking for a writable device: libblkio refuses to start (it read VIRTIO_BLK_F_RO).
    let mut b = Blkio::new("virtio-blk-vhost-user").unwrap();
    b.set_str("path", &sock.display().to_string()).unwrap();
    b.connect().unwrap();
    let e = b
        .start()
        .err()
        .expect("started read-write on a read-only export");
    assert!(e.message().contains("read-only"), "{}", e.message());
    drop(b);
    // Read-only, it reads the image.
    let mut b = Blkio::new("virtio-blk-vhost-user").unwrap();
    b.set_str("path", &sock.display().to_string()).unwrap();
    b.set_bool("read-only", true).unwrap();
    b.connect().unwrap();
    let mut started = b.start().unwrap();
    let region = b.alloc_mem_region(SPAN).unwrap();
    b.map_mem_region(&region).unwrap();
    let q = &mut started.queues[0];
    assert_eq!(one(q, false, 4096, region.addr, 4096), 0);
    // SAFETY: the region is mapped for SPAN bytes while `b` lives; no request is in flight.
    let got = unsafe { std::slice::from_raw_parts(region.addr as *const u8, 4096) };
    assert!(got.iter().all(|&x| x == 0x3c));
    drop(started);
    drop(b);
    peer.stop();
}

/// Aligned guest buffers go to the O_DIRECT file as they are (no copy), unaligned ones
/// through a buffer, with every I/O engine; the data is right either way.
#[test]
fn aligned_buffers_are_not_copied_and_unaligned_ones_are_on_every_engine() {
    for aio in ["io_uring", "native", "threads"] {
        let dir = tmpdir(&format!("blkio-zc-{aio}"));
        let img = dir.join("disk.img");
        std::fs::File::create(&img).unwrap().set_len(IMAGE).unwrap();
        let sock = dir.join("vhost.sock");
        let qmp = dir.join("qmp.sock");
        let s = Stord::start(
            &dir,
            &[
                "--object".into(),
                "iothread,id=io0".into(),
                "--blockdev".into(),
                format!(
                    "driver=file,node-name=disk,filename={},cache.direct=on,aio={aio}",
                    img.display()
                ),
                "--export".into(),
                format!(
                    "type=vhost-user-blk,id=vu0,node-name=disk,addr.type=unix,addr.path={},writable=on,iothread=io0",
                    sock.display()
                ),
                "--chardev".into(),
                format!("socket,id=mon,path={},server=on,wait=off", qmp.display()),
                "--monitor".into(),
                "chardev=mon".into(),
            ],
        );
        let mut q = common::rawqmp::RawQmp::connect(&qmp);
        let mut c = connect(&sock, 1, false);
        let base = c.region.addr;
        let q0 = &mut c.queues[0];
        let fill = |at: usize, len: usize, seed: usize| {
            // SAFETY: `at..at+len` lies inside the mapped region (SPAN bytes), which lives as
            // long as `c`; no request is in flight while we touch it.
            let m = unsafe { std::slice::from_raw_parts_mut(at as *mut u8, len) };
            for (j, b) in m.iter_mut().enumerate() {
                *b = pattern(seed, j);
            }
        };
        let check = |at: usize, len: usize, seed: usize| {
            // SAFETY: as above.
            let m = unsafe { std::slice::from_raw_parts(at as *const u8, len) };
            (0..len).all(|j| m[j] == pattern(seed, j))
        };
        let clear = |at: usize, len: usize| {
            // SAFETY: as above.
            unsafe { std::ptr::write_bytes(at as *mut u8, 0, len) };
        };

        // Page-aligned buffers: straight to and from the file.
        fill(base, BS, 1);
        assert_eq!(one(q0, true, 0, base, BS), 0);
        clear(base, BS);
        assert_eq!(one(q0, false, 0, base, BS), 0);
        assert!(check(base, BS, 1), "{aio}: aligned read back differs");
        assert_eq!(
            q.counter("block.bounced"),
            0,
            "{aio}: an aligned request was copied"
        );
        assert!(q.counter("virtqueue.requests") >= 2);

        // A buffer one byte off: copied through an aligned buffer, still right.
        let odd = base + BS + 1;
        fill(odd, 4096, 2);
        assert_eq!(one(q0, true, 1 << 20, odd, 4096), 0);
        clear(odd, 4096);
        assert_eq!(one(q0, false, 1 << 20, odd, 4096), 0);
        assert!(check(odd, 4096, 2), "{aio}: unaligned read back differs");
        assert_eq!(
            q.counter("block.bounced"),
            2,
            "{aio}: unaligned requests not copied"
        );
        drop(c);
        drop(s);
        let image = std::fs::read(&img).unwrap();
        assert!(
            (0..BS).all(|j| image[j] == pattern(1, j)),
            "{aio}: image differs"
        );
        assert!(
            (0..4096).all(|j| image[(1 << 20) + j] == pattern(2, j)),
            "{aio}: image differs at 1 MiB"
        );
    }
}

/// Set for the helper below: the socket it hammers.
const CHILD_SOCK: &str = "STORD_TEST_BLKIO_CHILD_SOCK";

/// Helper, not a test of its own: run by
/// `a_libblkio_client_killed_mid_io_leaves_the_export_serving` in a child process, which it
/// kills with SIGKILL while requests are in flight.
#[test]
#[ignore = "helper process for a_libblkio_client_killed_mid_io_leaves_the_export_serving"]
fn blkio_child_writes_until_killed() {
    let sock = std::env::var(CHILD_SOCK).expect("run by the parent test");
    let mut c = connect(Path::new(&sock), 1, false);
    let base = c.region.addr;
    let q = &mut c.queues[0];
    let mut i = 0u64;
    loop {
        // Eight writes in flight, then wait for them: the kill lands mid-batch.
        for k in 0..8usize {
            let off = ((i * 8 + k as u64) % 256) * BS as u64;
            q.write(off, (base + k * BS) as *const u8, BS, k, ReqFlags::empty());
        }
        let mut done: [MaybeUninit<Completion>; 8] = [const { MaybeUninit::uninit() }; 8];
        q.do_io(&mut done, 8, None, None).expect("do_io");
        i += 1;
    }
}

#[test]
fn a_libblkio_client_killed_mid_io_leaves_the_export_serving() {
    let dir = tmpdir("blkio-killed");
    let img = dir.join("disk.img");
    common::sparse_image(&img, IMAGE);
    let sock = dir.join("vhost.sock");
    let peer = Peer::start(false, &dir, &img, &sock, ",writable=on", 1);
    let Peer::Stord(s) = &peer else {
        unreachable!("stord")
    };
    // One client first, so what the first I/O sets up for good (the IoThread's ring and
    // its engine's descriptors) counts in the baseline.
    let mut c = connect(&sock, 1, false);
    write_and_verify(&mut c);
    drop(c);
    std::thread::sleep(Duration::from_millis(300));
    let fds = s.fd_count();
    for round in 0..3 {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "blkio_child_writes_until_killed",
                "--ignored",
                "--nocapture",
            ])
            .env(CHILD_SOCK, &sock)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(200 + 100 * round));
        if child.try_wait().unwrap().is_some() {
            let out = child.wait_with_output().unwrap();
            panic!(
                "the client died by itself: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        child.kill().unwrap();
        child.wait().unwrap();
    }
    // A new client connects and its data round-trips.
    let mut c = connect(&sock, 1, false);
    write_and_verify(&mut c);
    drop(c);
    // The killed clients' connections are gone: descriptors back to what they were.
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.fd_count() > fds {
        if Instant::now() > deadline {
            let list: Vec<String> = std::fs::read_dir(format!("/proc/{}/fd", s.pid()))
                .unwrap()
                .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
                .map(|p| p.display().to_string())
                .collect();
            panic!("descriptors {} -> {}: {list:?}", fds, s.fd_count());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One frontend at a time, as qsd, but nobody waits unanswered: a second frontend waits
/// for the first to leave and is then served (a reconnecting frontend lands there), and a
/// third, while both are there, is closed at once.
#[test]
fn a_second_frontend_waits_its_turn_and_a_third_is_refused() {
    use std::io::{Read, Write};
    let dir = tmpdir("blkio-frontends");
    let img = dir.join("disk.img");
    std::fs::write(&img, vec![0x5a; 1 << 20]).unwrap();
    let sock = dir.join("vhost.sock");
    let peer = Peer::start(false, &dir, &img, &sock, ",writable=on", 0);
    let first = connect(&sock, 1, false);
    let (tx, rx) = std::sync::mpsc::channel();
    let s2 = sock.clone();
    let second = std::thread::spawn(move || {
        let (_, data) = common::blkio_read(&s2, 8192, 4096);
        tx.send(data).unwrap();
    });
    // Served only once the first leaves.
    assert!(rx.recv_timeout(Duration::from_millis(700)).is_err());
    // A third: connected by the kernel, then closed by stord without an answer to its
    // first message (GET_FEATURES), instead of hanging.
    let mut third = std::os::unix::net::UnixStream::connect(&sock).unwrap();
    third
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut hdr = [0u8; 12];
    hdr[0..4].copy_from_slice(&1u32.to_le_bytes());
    hdr[4..8].copy_from_slice(&1u32.to_le_bytes());
    let _ = third.write_all(&hdr);
    let mut buf = [0u8; 64];
    let t = Instant::now();
    let n = third.read(&mut buf);
    assert!(
        matches!(n, Ok(0))
            || matches!(&n, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset),
        "third frontend: {n:?} after {:?}",
        t.elapsed()
    );
    drop(first);
    let data = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the waiting frontend was never served");
    assert!(data.iter().all(|&b| b == 0x5a));
    second.join().unwrap();
    peer.stop();
}

/// A frontend that shrinks its guest memory under the daemon (the memfd truncated to 0
/// after a working round trip, then a request whose buffer lies there) costs only its own
/// connection: the daemon does not die of SIGBUS, the export takes the next frontend, and
/// the NBD export beside it serves throughout.
#[test]
fn a_frontend_that_shrinks_its_memory_costs_only_its_connection() {
    let dir = tmpdir("blkio-shrink");
    let vsock = dir.join("vhost.sock");
    let nsock = dir.join("nbd.sock");
    let mut args = monitor_args(&dir.join("qmp.sock"));
    args.extend([
        "--blockdev".into(),
        "driver=null-co,node-name=z,size=64M,read-zeroes=on".into(),
        "--nbd-server".into(),
        format!("addr.type=unix,addr.path={}", nsock.display()),
        "--export".into(),
        "type=nbd,id=n,node-name=z,name=z".into(),
        "--export".into(),
        format!(
            "type=vhost-user-blk,id=v,node-name=z,addr.type=unix,addr.path={}",
            vsock.display()
        ),
    ]);
    let mut s = Stord::start(&dir, &args);
    {
        let mut b = Blkio::new("virtio-blk-vhost-user").unwrap();
        b.set_str("path", &vsock.display().to_string()).unwrap();
        b.set_bool("read-only", true).unwrap();
        b.connect().unwrap();
        let mut started = b.start().unwrap();
        let region = b.alloc_mem_region(SPAN).unwrap();
        b.map_mem_region(&region).unwrap();
        let q = &mut started.queues[0];
        assert_eq!(one(q, false, 0, region.addr, 4096), 0);
        // SAFETY: ftruncate on the region's own descriptor, which libblkio keeps open.
        let r = unsafe { libc::ftruncate(region.fd, 0) };
        assert_eq!(r, 0, "ftruncate: {}", std::io::Error::last_os_error());
        // The daemon writes zeroes into a buffer that is no longer backed. The request
        // fails or the connection goes; either way the daemon lives.
        q.read(8192, region.addr as *mut u8, 4096, 1, ReqFlags::empty());
        let mut c = [MaybeUninit::<Completion>::uninit()];
        let mut limit = Duration::from_secs(3);
        let _ = q.do_io(&mut c, 1, Some(&mut limit), None);
    }
    assert!(s.is_running(), "the daemon died");
    let mut nbd = common::rawnbd::RawNbd::connect(&nsock, "z");
    assert_eq!(nbd.read(1, 0, 4096), (0, vec![0; 4096]));
    // The export takes the next frontend.
    let (cap, data) = common::blkio_read(&vsock, 0, 4096);
    assert_eq!((cap, data), (64 << 20, vec![0; 4096]));
    drop(s);
}

/// A guest on a vhost-user-blk export keeps going through a mirror's pivot: a libblkio
/// client writes and reads back its pattern in a loop while blockdev-mirror copies the
/// disk to another file, becomes ready and is completed. No request fails or reads wrong,
/// the export then serves the target (query-block-exports), and the target file holds
/// every byte the client wrote last, before and after the pivot.
#[test]
fn a_libblkio_client_runs_through_a_mirror_pivot() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Arc;
    let dir = tmpdir("blkio-mirror");
    let (img, dst) = (dir.join("disk.img"), dir.join("dst.img"));
    common::sparse_image(&img, IMAGE);
    common::sparse_image(&dst, IMAGE);
    let sock = dir.join("vhost.sock");
    let mut args: Vec<String> = ["--object", "iothread,id=io0", "--blockdev"]
        .map(String::from)
        .to_vec();
    args.push(format!(
        "driver=file,node-name=disk,filename={},aio=io_uring",
        img.display()
    ));
    args.push("--blockdev".into());
    args.push(format!(
        "driver=file,node-name=dst,filename={},aio=io_uring",
        dst.display()
    ));
    args.push("--export".into());
    args.push(format!(
        "type=vhost-user-blk,id=vu0,node-name=disk,addr.type=unix,addr.path={},\
         writable=on,iothread=io0",
        sock.display()
    ));
    args.extend(monitor_args(&dir.join("qmp.sock")));
    let mut s = Stord::start(&dir, &args);
    let mut q = RawQmp::connect(&dir.join("qmp.sock"));

    let stop = Arc::new(AtomicBool::new(false));
    let rounds = Arc::new(AtomicUsize::new(0));
    let (stop2, rounds2) = (stop.clone(), rounds.clone());
    let client = std::thread::spawn(move || {
        let mut c = connect(&sock, 1, false);
        let buf = c.region.addr;
        let q0 = &mut c.queues[0];
        let mut round = 0usize;
        let mut last = Vec::new();
        while !stop2.load(Ordering::SeqCst) || round < 3 {
            // SAFETY: the region is mapped for SPAN bytes while `c` lives, and no request
            // uses it between the calls below.
            let mem = unsafe { std::slice::from_raw_parts_mut(buf as *mut u8, SPAN) };
            for (j, b) in mem.iter_mut().enumerate() {
                *b = pattern(round, j);
            }
            for k in (0..SPAN).step_by(BS) {
                assert_eq!(one(q0, true, 8 * SPAN as u64 + k as u64, buf + k, BS), 0);
            }
            // SAFETY: as above.
            unsafe { std::slice::from_raw_parts_mut(buf as *mut u8, SPAN) }.fill(0);
            for k in (0..SPAN).step_by(BS) {
                assert_eq!(one(q0, false, 8 * SPAN as u64 + k as u64, buf + k, BS), 0);
            }
            // SAFETY: as above.
            let mem = unsafe { std::slice::from_raw_parts(buf as *const u8, SPAN) };
            let bad = (0..SPAN).find(|&j| mem[j] != pattern(round, j));
            assert_eq!(bad, None, "round {round}: read back differs");
            last = mem.to_vec();
            round += 1;
            rounds2.store(round, Ordering::SeqCst);
        }
        last
    });
    while rounds.load(Ordering::SeqCst) < 2 {
        std::thread::sleep(Duration::from_millis(10));
    }
    let r = q.send(
        r#"{"execute":"blockdev-mirror","arguments":{"job-id":"m","device":"disk","target":"dst","sync":"full"}}"#,
    );
    assert!(r.get("return").is_some(), "{r}");
    q.wait_event("BLOCK_JOB_READY", "device", "m");
    let before = rounds.load(Ordering::SeqCst);
    let r = q.send(r#"{"execute":"job-complete","arguments":{"id":"m"}}"#);
    assert!(r.get("return").is_some(), "{r}");
    let done = q.wait_event("BLOCK_JOB_COMPLETED", "device", "m");
    assert!(done["data"].get("error").is_none(), "{done}");
    let r = q.send(r#"{"execute":"query-block-exports"}"#);
    assert_eq!(r["return"][0]["node-name"], "dst", "{r}");
    // A few more rounds on the target, then stop.
    let after = rounds.load(Ordering::SeqCst);
    while rounds.load(Ordering::SeqCst) < after + 3 {
        std::thread::sleep(Duration::from_millis(10));
    }
    stop.store(true, Ordering::SeqCst);
    let last = client.join().expect("the client saw an error");
    assert!(rounds.load(Ordering::SeqCst) > before);
    s.stop_and_stderr();
    let image = std::fs::read(&dst).unwrap();
    assert!(
        image[8 * SPAN..9 * SPAN] == last[..],
        "the target does not hold the client's last round"
    );
}

/// The export over an `nbd` node (qemu-nbd serving a file): libblkio's requests go to the
/// node's connection from the export's IoThread and back; the server's file holds what
/// every queue wrote.
#[test]
fn libblkio_round_trips_data_over_an_nbd_node() {
    let dir = tmpdir("blkio-nbd-node");
    let img = dir.join("disk.img");
    std::fs::File::create(&img).unwrap().set_len(IMAGE).unwrap();
    let nbd_sock = dir.join("server.sock");
    let mut server = Command::new("qemu-nbd")
        .args(["-f", "raw", "-x", "exp", "-t", "-k"])
        .arg(&nbd_sock)
        .arg(&img)
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn qemu-nbd");
    let t = Instant::now();
    while !nbd_sock.exists() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "qemu-nbd did not listen"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let sock = dir.join("vhost.sock");
    let mut args: Vec<String> = vec![
        "--object".into(),
        "iothread,id=io0".into(),
        "--object".into(),
        "iothread,id=io1".into(),
        "--blockdev".into(),
        format!(
            "driver=nbd,node-name=disk,server.type=unix,server.path={},export=exp",
            nbd_sock.display()
        ),
        "--export".into(),
        format!(
            "type=vhost-user-blk,id=vu0,node-name=disk,addr.type=unix,addr.path={},\
             writable=on,num-queues=2,iothread.0=io0,iothread.1=io1",
            sock.display()
        ),
    ];
    args.extend(monitor_args(&dir.join("qmp.sock")));
    let peer = Peer::Stord(Stord::start(&dir, &args));
    let mut c = connect(&sock, 2, false);
    assert_eq!(c.blkio.get_u64("capacity").unwrap(), IMAGE);
    let written = write_and_verify(&mut c);
    drop(c);
    peer.stop();
    let _ = server.kill();
    let _ = server.wait();
    let image = std::fs::read(&img).unwrap();
    for (offset, data) in written {
        let at = offset as usize;
        assert!(
            image[at..at + SPAN] == data[..],
            "the server's file does not hold what the queue at {offset} wrote"
        );
    }
}

/// The export over an `rbd` node on a one-OSD Ceph cluster (scripts/ceph-cluster.sh):
/// librbd completes on its own threads and hands each request back to the export's
/// IoThread; `rbd export` of the image holds what every queue wrote.
#[test]
fn libblkio_round_trips_data_over_an_rbd_node() {
    let dir = tmpdir("blkio-rbd-node");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/ceph-cluster.sh");
    let ceph = dir.join("ceph");
    let port = 37000 + std::process::id() % 1000;
    let out = Command::new(&script)
        .arg("start")
        .arg(&ceph)
        .env("CEPH_MON_PORT", port.to_string())
        .output()
        .expect("ceph-cluster.sh");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Stops the cluster however the test ends.
    struct Stop<'a>(&'a Path, &'a Path);
    impl Drop for Stop<'_> {
        fn drop(&mut self) {
            let _ = Command::new(self.0).arg("stop").arg(self.1).status();
        }
    }
    let _stop = Stop(&script, &ceph);
    let conf = String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .unwrap()
        .to_string();
    let rbd = |args: &[&str]| {
        let o = Command::new("rbd")
            .arg("-c")
            .arg(&conf)
            .args(args)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    };
    rbd(&["create", "rbd/vu", "--size", "64M"]);
    let sock = dir.join("vhost.sock");
    let mut args: Vec<String> = vec![
        "--object".into(),
        "iothread,id=io0".into(),
        "--blockdev".into(),
        format!("driver=rbd,node-name=disk,pool=rbd,image=vu,conf={conf}"),
        "--export".into(),
        format!(
            "type=vhost-user-blk,id=vu0,node-name=disk,addr.type=unix,addr.path={},\
             writable=on,iothread=io0",
            sock.display()
        ),
    ];
    args.extend(monitor_args(&dir.join("qmp.sock")));
    let peer = Peer::Stord(Stord::start(&dir, &args));
    let mut c = connect(&sock, 1, false);
    assert_eq!(c.blkio.get_u64("capacity").unwrap(), IMAGE);
    let written = write_and_verify(&mut c);
    drop(c);
    peer.stop();
    let exported = dir.join("export.raw");
    rbd(&["export", "rbd/vu", exported.to_str().unwrap()]);
    let image = std::fs::read(&exported).unwrap();
    for (offset, data) in written {
        let at = offset as usize;
        assert!(
            image[at..at + SPAN] == data[..],
            "the rbd image does not hold what the queue at {offset} wrote"
        );
    }
}
