//! The wake-up scenario: read 128 MiB with O_DIRECT in 128 KiB chunks, in batches of 16;
//! sleep 1 ms before submitting each batch and 1 ms after reaping each completion.
//!
//! The client is idle most of the time, so completions land while the daemon's loop
//! sleeps: a daemon whose completions (or cross-thread work) do not wake its loop at once
//! stalls until some timer fires, and the run takes far longer than the raw file's floor
//! (64 batches x 17 sleeps of 1 ms, about 1.1 s). Two clients: io_uring on a file (the raw
//! image or a FUSE-mounted one) and a minimal NBD client of our own.

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use io_uring::{opcode, types, IoUring};
use stord_aio::AlignedBuf;

const TOTAL: u64 = 128 << 20;
const CHUNK: usize = 128 << 10;
const BATCH: usize = 16;
const PAUSE: Duration = Duration::from_millis(1);

/// Runs the scenario on `path` through io_uring; returns the seconds it took.
pub fn file(path: &Path) -> f64 {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .unwrap_or_else(|e| panic!("open {} with O_DIRECT: {e}", path.display()));
    let mut ring = IoUring::new(BATCH as u32).expect("io_uring");
    let mut bufs: Vec<AlignedBuf> = (0..BATCH)
        .map(|_| AlignedBuf::zeroed(CHUNK, 4096))
        .collect();
    let t0 = Instant::now();
    let mut offset = 0;
    while offset < TOTAL {
        std::thread::sleep(PAUSE);
        for (i, b) in bufs.iter_mut().enumerate() {
            let e = opcode::Read::new(types::Fd(f.as_raw_fd()), b.as_mut_ptr(), CHUNK as u32)
                .offset(offset + (i * CHUNK) as u64)
                .build()
                .user_data(i as u64);
            // Every read is reaped below before `bufs` is touched again or dropped.
            // SAFETY: the buffer `b` outlives the read (see above).
            unsafe { ring.submission().push(&e).expect("queue has room") };
        }
        ring.submit().expect("io_uring_enter");
        for _ in 0..BATCH {
            ring.submit_and_wait(1).expect("io_uring_enter");
            let c = ring.completion().next().expect("a completion");
            assert_eq!(c.result(), CHUNK as i32, "short or failed read");
            std::thread::sleep(PAUSE);
        }
        offset += (BATCH * CHUNK) as u64;
    }
    t0.elapsed().as_secs_f64()
}

const NBD_REQUEST_MAGIC: u32 = 0x2560_9513;
const NBD_REPLY_MAGIC: u32 = 0x6744_6698;

/// Opens export `name` on the NBD server at `sock` (fixed newstyle, NBD_OPT_EXPORT_NAME);
/// returns the stream and the export size.
fn nbd_connect(sock: &Path, name: &str) -> (UnixStream, u64) {
    let mut s = UnixStream::connect(sock).expect("connect to the NBD socket");
    let mut hello = [0u8; 18];
    s.read_exact(&mut hello).expect("NBD greeting");
    assert_eq!(&hello[..8], b"NBDMAGIC", "not an NBD server");
    assert_eq!(&hello[8..16], b"IHAVEOPT", "not a newstyle NBD server");
    // Client flags: FIXED_NEWSTYLE | NO_ZEROES.
    s.write_all(&3u32.to_be_bytes()).unwrap();
    let mut opt = Vec::new();
    opt.extend_from_slice(b"IHAVEOPT");
    opt.extend_from_slice(&1u32.to_be_bytes()); // NBD_OPT_EXPORT_NAME
    opt.extend_from_slice(&(name.len() as u32).to_be_bytes());
    opt.extend_from_slice(name.as_bytes());
    s.write_all(&opt).unwrap();
    let mut info = [0u8; 10];
    s.read_exact(&mut info).expect("export info");
    let size = u64::from_be_bytes(info[..8].try_into().unwrap());
    (s, size)
}

/// Runs the scenario against export `name` of the NBD server at `sock`.
pub fn nbd(sock: &Path, name: &str) -> f64 {
    let (mut s, size) = nbd_connect(sock, name);
    assert!(size >= TOTAL, "export smaller than 128 MiB");
    let mut data = vec![0u8; CHUNK];
    let t0 = Instant::now();
    let mut offset = 0;
    while offset < TOTAL {
        std::thread::sleep(PAUSE);
        let mut reqs = Vec::with_capacity(28 * BATCH);
        for i in 0..BATCH {
            reqs.extend_from_slice(&NBD_REQUEST_MAGIC.to_be_bytes());
            reqs.extend_from_slice(&0u16.to_be_bytes()); // flags
            reqs.extend_from_slice(&0u16.to_be_bytes()); // NBD_CMD_READ
            reqs.extend_from_slice(&(i as u64).to_be_bytes()); // handle
            reqs.extend_from_slice(&(offset + (i * CHUNK) as u64).to_be_bytes());
            reqs.extend_from_slice(&(CHUNK as u32).to_be_bytes());
        }
        s.write_all(&reqs).expect("send requests");
        for _ in 0..BATCH {
            let mut hdr = [0u8; 16];
            s.read_exact(&mut hdr).expect("reply header");
            assert_eq!(
                u32::from_be_bytes(hdr[..4].try_into().unwrap()),
                NBD_REPLY_MAGIC
            );
            let err = u32::from_be_bytes(hdr[4..8].try_into().unwrap());
            assert_eq!(err, 0, "NBD read failed with error {err}");
            s.read_exact(&mut data).expect("read data");
            std::thread::sleep(PAUSE);
        }
        offset += (BATCH * CHUNK) as u64;
    }
    let elapsed = t0.elapsed().as_secs_f64();
    // NBD_CMD_DISC.
    let mut disc = Vec::new();
    disc.extend_from_slice(&NBD_REQUEST_MAGIC.to_be_bytes());
    disc.extend_from_slice(&0u16.to_be_bytes());
    disc.extend_from_slice(&2u16.to_be_bytes());
    disc.extend_from_slice(&[0u8; 20]);
    let _ = s.write_all(&disc);
    elapsed
}
