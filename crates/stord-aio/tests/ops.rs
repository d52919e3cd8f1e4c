//! The completion-based operations, on both reactors, against real files and sockets.

use std::cell::Cell;
use std::fs::OpenOptions;
use std::future::Future;
use std::io::{Read as _, Write as _};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::UnixStream;
use std::rc::Rc;
use std::time::{Duration, Instant};

use stord_aio::{op, AioContext, AioContextOptions, AlignedBuf, Interest, PollParams, ReactorKind};

const REACTORS: [ReactorKind; 2] = [ReactorKind::IoUring, ReactorKind::Epoll];

fn ctx(reactor: ReactorKind) -> AioContext {
    AioContext::new(AioContextOptions {
        name: "ops".into(),
        reactor,
        poll: PollParams::default(),
        ..AioContextOptions::default()
    })
    .unwrap()
}

fn temp_path(tag: &str) -> std::path::PathBuf {
    // Under the target dir: on the same filesystem as the repo, where O_DIRECT works.
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
    dir.join(format!("stord-aio-{tag}-{}", std::process::id()))
}

#[test]
fn file_ops_with_o_direct() {
    for reactor in REACTORS {
        let path = temp_path(&format!("direct-{reactor}"));
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)
            .unwrap();
        let fd = f.as_raw_fd();
        let c = ctx(reactor);
        c.block_on(async move {
            // write + read back one aligned block
            let mut buf = AlignedBuf::zeroed(4096, 4096);
            buf.iter_mut()
                .enumerate()
                .for_each(|(i, b)| *b = (i % 251) as u8);
            let (n, buf) = op::write(fd, buf, 8192).await;
            assert_eq!(n.unwrap(), 4096);
            let (n, back) = op::read(fd, AlignedBuf::zeroed(4096, 4096), 8192).await;
            assert_eq!(n.unwrap(), 4096);
            assert_eq!(&back[..], &buf[..]);

            // writev two blocks, readv them back in the other order of sizes
            let a = AlignedBuf::zeroed(4096, 4096);
            let mut b = AlignedBuf::zeroed(8192, 4096);
            b.fill(0xab);
            let (n, _) = op::writev(fd, vec![a, b], 0).await;
            assert_eq!(n.unwrap(), 12288);
            let bufs = vec![
                AlignedBuf::zeroed(8192, 4096),
                AlignedBuf::zeroed(4096, 4096),
            ];
            let (n, bufs) = op::readv(fd, bufs, 0).await;
            assert_eq!(n.unwrap(), 12288);
            assert!(bufs[0][..4096].iter().all(|&x| x == 0));
            assert!(bufs[0][4096..].iter().all(|&x| x == 0xab));
            assert!(bufs[1].iter().all(|&x| x == 0xab));

            // FUA-style write, fsync, fdatasync
            let (n, _) = op::writev_flags(
                fd,
                vec![AlignedBuf::zeroed(4096, 4096)],
                16384,
                libc::RWF_DSYNC,
            )
            .await;
            assert_eq!(n.unwrap(), 4096);
            op::fsync(fd, false).await.unwrap();
            op::fsync(fd, true).await.unwrap();

            // fallocate: extend, then punch a hole (reads back as zeroes)
            op::fallocate(fd, 0, 0, 1 << 20).await.unwrap();
            op::fallocate(
                fd,
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                8192,
                4096,
            )
            .await
            .unwrap();
            let (n, hole) = op::read(fd, AlignedBuf::zeroed(4096, 4096), 8192).await;
            assert_eq!(n.unwrap(), 4096);
            assert!(hole.iter().all(|&x| x == 0));

            // errors come back as io::Error with the errno: misaligned O_DIRECT read
            let (n, _) = op::read(fd, vec![0u8; 100], 1).await;
            assert_eq!(n.unwrap_err().raw_os_error(), Some(libc::EINVAL));
            // end of file: a short read
            let (n, _) = op::read(fd, AlignedBuf::zeroed(8192, 4096), (1 << 20) - 4096).await;
            assert_eq!(n.unwrap(), 4096);
        });
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 1 << 20);
        drop(c);
        std::fs::remove_file(&path).unwrap();
    }
}

#[test]
fn socket_ops_and_poll_add() {
    for reactor in REACTORS {
        let (a, mut b) = UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        let afd = a.as_raw_fd();
        let c = ctx(reactor);
        let peer = std::thread::spawn(move || {
            let mut got = [0u8; 5];
            b.read_exact(&mut got).unwrap();
            assert_eq!(&got, b"hello");
            std::thread::sleep(Duration::from_millis(20));
            b.write_all(b"world").unwrap();
            b
        });
        c.block_on(async move {
            let (n, _) = op::send(afd, b"hello".to_vec(), 0).await;
            assert_eq!(n.unwrap(), 5);
            // The peer answers 20 ms later: recv waits for it without blocking the loop.
            let (n, buf) = op::recv(afd, vec![0u8; 16], 0).await;
            let n = n.unwrap();
            assert_eq!(&buf[..n], b"world");
            // Nothing to read now; poll-add for writability completes at once.
            let r = op::poll_add(afd, Interest::WRITABLE).await.unwrap();
            assert!(r.is_writable());
        });
        let mut b = peer.join().unwrap();
        // poll-add readable waits until the peer writes.
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(10));
            b.write_all(b"x").unwrap();
            b
        });
        let r = c.block_on(op::poll_add(afd, Interest::READABLE)).unwrap();
        assert!(r.is_readable(), "{reactor}");
        let b = writer.join().unwrap();
        // end of stream: recv returns 0
        drop(b.shutdown(std::net::Shutdown::Write));
        let n = c
            .block_on(async move {
                let (_, _) = op::recv(afd, vec![0u8; 1], 0).await; // the "x"
                op::recv(afd, vec![0u8; 1], 0).await.0
            })
            .unwrap();
        assert_eq!(n, 0, "{reactor}");
        drop(a);
    }
}

#[test]
fn ring_timeout_completes_after_its_duration() {
    for reactor in REACTORS {
        let c = ctx(reactor);
        let t0 = Instant::now();
        c.block_on(op::timeout(Duration::from_millis(5))).unwrap();
        let el = t0.elapsed();
        assert!(
            el >= Duration::from_millis(5) && el < Duration::from_millis(500),
            "{el:?}"
        );
    }
}

#[test]
fn dropping_an_in_flight_op_keeps_the_loop_sound() {
    for reactor in REACTORS {
        let (a, mut b) = UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        let afd = a.as_raw_fd();
        let c = ctx(reactor);
        // A recv that will never complete on its own, abandoned mid-flight: its buffer is
        // parked until the kernel cancels it.
        let handle = c.spawn(async move {
            let _ = op::recv(afd, vec![0u8; 4096], 0).await;
            unreachable!("nothing was sent");
        });
        for _ in 0..3 {
            c.run_once(false);
        }
        assert!(!handle.is_finished());
        // Let the task go: spawn another that ends the first by dropping... tasks cannot be
        // aborted, so drop the whole context with the recv in flight instead.
        drop(c);
        // The peer writes now; the cancelled recv must not scribble anywhere.
        b.write_all(&[1u8; 4096]).unwrap();
        // A fresh context on the same thread works and sees the data.
        let c = ctx(reactor);
        let (n, buf) = c.block_on(op::recv(afd, vec![0u8; 8192], 0));
        assert_eq!(n.unwrap(), 4096, "{reactor}");
        assert!(buf[..4096].iter().all(|&x| x == 1));
        // And a select-style drop: a timeout racing a recv that never completes.
        let done = Rc::new(Cell::new(false));
        let d = done.clone();
        c.block_on(async move {
            let recv = std::pin::pin!(op::recv(afd, vec![0u8; 64], 0));
            let tmo = std::pin::pin!(op::timeout(Duration::from_millis(2)));
            let mut recv = Some(recv);
            let mut tmo = tmo;
            std::future::poll_fn(|cx| {
                if let Some(r) = recv.as_mut() {
                    if r.as_mut().poll(cx).is_ready() {
                        panic!("recv completed with nothing sent");
                    }
                }
                if tmo.as_mut().poll(cx).is_ready() {
                    recv = None; // dropped while in flight
                    return std::task::Poll::Ready(());
                }
                std::task::Poll::Pending
            })
            .await;
            d.set(true);
        });
        assert!(done.get());
        // The loop still serves I/O afterwards.
        b.write_all(b"ok").unwrap();
        let (n, buf) = c.block_on(op::recv(afd, vec![0u8; 8], 0));
        assert_eq!(&buf[..n.unwrap()], b"ok");
    }
}

#[test]
fn fd_handlers_are_level_triggered_and_removable() {
    for reactor in REACTORS {
        let (a, mut b) = UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        let c = ctx(reactor);
        let calls = Rc::new(Cell::new(0));
        let k = calls.clone();
        let mut reader = a.try_clone().unwrap();
        let id = c
            .set_fd_handler(a.as_raw_fd(), Interest::READABLE, move |r| {
                assert!(r.is_readable());
                k.set(k.get() + 1);
                // Read one byte per call: the handler is called again while data remains.
                let mut one = [0u8; 1];
                let _ = reader.read(&mut one);
            })
            .unwrap();
        b.write_all(b"abc").unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while calls.get() < 3 {
            assert!(
                Instant::now() < deadline,
                "{reactor}: handler calls {}",
                calls.get()
            );
            c.run_once(true);
        }
        // Drained: no more calls.
        for _ in 0..5 {
            c.run_once(false);
        }
        assert_eq!(calls.get(), 3);
        c.remove_fd_handler(id);
        b.write_all(b"d").unwrap();
        for _ in 0..5 {
            c.run_once(false);
        }
        std::thread::sleep(Duration::from_millis(5));
        for _ in 0..5 {
            c.run_once(false);
        }
        assert_eq!(calls.get(), 3, "{reactor}: removed handler was called");
    }
}

/// The io-wq workers the kernel started for rings this thread submitted to.
fn my_io_workers() -> usize {
    let name = format!("iou-wrk-{}", stord_aio::sys::gettid());
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|comm| comm.trim() == name)
        .count()
}

#[test]
fn an_operation_marked_in_worker_goes_to_the_kernels_workers() {
    let path = temp_path("in-worker");
    std::fs::write(&path, vec![0x5au8; 65536]).unwrap();
    let f = std::fs::File::open(&path).unwrap();
    let fd = f.as_raw_fd();
    // Each read runs on a thread of its own, so the workers counted are its ring's alone.
    let read = |punt: bool| {
        std::thread::spawn(move || {
            let c = ctx(ReactorKind::IoUring);
            let (n, buf) = c.block_on(op::read(fd, vec![0u8; 4096], 8192).in_worker_if(punt));
            assert_eq!(n.unwrap(), 4096);
            assert!(buf.iter().all(|&b| b == 0x5a));
            my_io_workers()
        })
        .join()
        .unwrap()
    };
    // A read of cached pages is done inline, while the ring is entered...
    assert_eq!(read(false), 0, "an unmarked cached read went to a worker");
    // ...unless it is marked: then a worker does it.
    assert!(read(true) >= 1, "a marked read was not handed to a worker");
    // The epoll reactor does it synchronously, mark or not.
    let c = ctx(ReactorKind::Epoll);
    let (n, _) = c.block_on(op::read(fd, vec![0u8; 4096], 0).in_worker_if(true));
    assert_eq!(n.unwrap(), 4096);
    drop(f);
    std::fs::remove_file(&path).unwrap();
}
