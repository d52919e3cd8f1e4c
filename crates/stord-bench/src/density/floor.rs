//! `floor`: what the kernel alone costs a request, measured beside the daemons.
//!
//! At a light, paced load every request wakes a sleeping thread, and on a small virtual
//! machine the sleep, the wake-up and the two socket operations cost more than any daemon's
//! own work. To tell the one from the other, the density benchmark can run this minimal NBD
//! server as a set-up of its own: one thread and one io_uring per connection (the shapes
//! connect one client per export), the ring set up as stord's (SINGLE_ISSUER,
//! DEFER_TASKRUN, TASKRUN_FLAG) and the thread on stord's loops' scheduler slice; each
//! request is one receive through the ring, the thread's sleep in io_uring_enter until it
//! completes, and one write of the reply. It answers reads of a null device with a hole
//! chunk, as stord and qsd answer reads of `null-co` with `read-zeroes`, and refuses
//! everything else. What a daemon spends per request above this floor is its own work.
//!
//! It takes a daemon's command line (`--nbd-server addr.type=unix,addr.path=P`, `--pidfile
//! F`; the nodes, exports and IoThreads are ignored), so the density benchmark starts it
//! as it starts qsd.

use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;

use io_uring::{opcode, types, IoUring};

use crate::media::IMAGE_SIZE;

const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const FLAG_FIXED_NEWSTYLE: u16 = 1;
const FLAG_NO_ZEROES: u16 = 2;
const OPT_ABORT: u32 = 2;
const OPT_INFO: u32 = 6;
const OPT_GO: u32 = 7;
const OPT_STRUCTURED_REPLY: u32 = 8;
const REP_ACK: u32 = 1;
const REP_INFO: u32 = 3;
const REP_ERR_UNSUP: u32 = 0x8000_0001;
const INFO_EXPORT: u16 = 0;
const TFLAG_HAS_FLAGS: u16 = 1;
const TFLAG_READ_ONLY: u16 = 2;
const TFLAG_SEND_DF: u16 = 1 << 7;
const REQUEST_MAGIC: u32 = 0x2560_9513;
const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;
const CMD_READ: u16 = 0;
const CMD_DISC: u16 = 2;
const REPLY_FLAG_DONE: u16 = 1;
const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
const EINVAL: u32 = 22;
/// Option data this server reads (libnbd's options are a few bytes).
const MAX_OPTION: u32 = 4096;
/// The longest read answered without structured replies (its zeroes are sent).
const MAX_SIMPLE_READ: u32 = 1 << 20;

/// `stord-bench floor-server ARGS`: serves until killed.
pub fn serve_command(args: &[String]) {
    let (sock, pidfile) = socket_and_pidfile(args);
    let _ = std::fs::remove_file(&sock);
    let listener = UnixListener::bind(&sock)
        .unwrap_or_else(|e| panic!("floor: cannot listen on {}: {e}", sock.display()));
    if let Some(p) = pidfile {
        std::fs::write(p, format!("{}\n", std::process::id())).expect("floor: pidfile");
    }
    for conn in listener.incoming() {
        let Ok(conn) = conn else { continue };
        std::thread::spawn(move || {
            if let Ok(structured) = handshake(&mut &conn) {
                let _ = transmission(&conn, structured);
            }
        });
    }
}

/// The NBD server's socket and the pidfile, from a daemon's command line.
fn socket_and_pidfile(args: &[String]) -> (PathBuf, Option<PathBuf>) {
    let mut sock = None;
    let mut pidfile = None;
    for pair in args.windows(2) {
        match pair[0].as_str() {
            "--nbd-server" => {
                sock = pair[1]
                    .split(',')
                    .find_map(|kv| kv.strip_prefix("addr.path="))
                    .map(PathBuf::from);
            }
            "--pidfile" => pidfile = Some(PathBuf::from(&pair[1])),
            _ => {}
        }
    }
    let sock = sock.expect("floor: --nbd-server addr.type=unix,addr.path=P");
    (sock, pidfile)
}

fn read_u32(s: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    s.read_exact(&mut b)?;
    Ok(u32::from_be_bytes(b))
}

fn option_reply(s: &mut impl Write, opt: u32, kind: u32, data: &[u8]) -> io::Result<()> {
    let mut r = Vec::with_capacity(20 + data.len());
    r.extend_from_slice(&OPT_REPLY_MAGIC.to_be_bytes());
    r.extend_from_slice(&opt.to_be_bytes());
    r.extend_from_slice(&kind.to_be_bytes());
    r.extend_from_slice(&(data.len() as u32).to_be_bytes());
    r.extend_from_slice(data);
    s.write_all(&r)
}

/// The fixed newstyle handshake up to NBD_OPT_GO (any export name: a read-only device of
/// the benchmark image's size); whether structured replies were agreed.
fn handshake<S: Read + Write>(s: &mut S) -> io::Result<bool> {
    let mut hello = Vec::with_capacity(18);
    hello.extend_from_slice(&NBDMAGIC.to_be_bytes());
    hello.extend_from_slice(&IHAVEOPT.to_be_bytes());
    hello.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    s.write_all(&hello)?;
    read_u32(s)?;
    let mut structured = false;
    loop {
        let mut h = [0u8; 16];
        s.read_exact(&mut h)?;
        let magic = u64::from_be_bytes(h[0..8].try_into().expect("8"));
        let opt = u32::from_be_bytes(h[8..12].try_into().expect("4"));
        let len = u32::from_be_bytes(h[12..16].try_into().expect("4"));
        if magic != IHAVEOPT || len > MAX_OPTION {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "bad option"));
        }
        let mut data = vec![0u8; len as usize];
        s.read_exact(&mut data)?;
        match opt {
            OPT_STRUCTURED_REPLY => {
                structured = true;
                option_reply(s, opt, REP_ACK, &[])?;
            }
            OPT_GO | OPT_INFO => {
                let mut flags = TFLAG_HAS_FLAGS | TFLAG_READ_ONLY;
                if structured {
                    flags |= TFLAG_SEND_DF;
                }
                let mut info = INFO_EXPORT.to_be_bytes().to_vec();
                info.extend_from_slice(&IMAGE_SIZE.to_be_bytes());
                info.extend_from_slice(&flags.to_be_bytes());
                option_reply(s, opt, REP_INFO, &info)?;
                option_reply(s, opt, REP_ACK, &[])?;
                if opt == OPT_GO {
                    return Ok(structured);
                }
            }
            OPT_ABORT => {
                let _ = option_reply(s, opt, REP_ACK, &[]);
                return Err(io::Error::new(io::ErrorKind::Interrupted, "aborted"));
            }
            _ => option_reply(s, opt, REP_ERR_UNSUP, &[])?,
        }
    }
}

/// A ring set up as stord's, with the best flags the kernel takes.
fn ring() -> io::Result<IoUring> {
    let full = IoUring::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .setup_taskrun_flag()
        .build(64);
    full.or_else(|_| IoUring::builder().setup_coop_taskrun().build(64))
}

/// The reply to the request in `h`, appended to `out`; false at NBD_CMD_DISC.
fn answer(h: &[u8], structured: bool, out: &mut Vec<u8>) -> io::Result<bool> {
    let magic = u32::from_be_bytes(h[0..4].try_into().expect("4"));
    let kind = u16::from_be_bytes(h[6..8].try_into().expect("2"));
    let handle = &h[8..16];
    let offset = &h[16..24];
    let len = &h[24..28];
    if magic != REQUEST_MAGIC {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "bad request"));
    }
    match kind {
        CMD_DISC => return Ok(false),
        CMD_READ if structured => {
            out.extend_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
            out.extend_from_slice(&REPLY_FLAG_DONE.to_be_bytes());
            out.extend_from_slice(&REPLY_TYPE_OFFSET_HOLE.to_be_bytes());
            out.extend_from_slice(handle);
            out.extend_from_slice(&12u32.to_be_bytes());
            out.extend_from_slice(offset);
            out.extend_from_slice(len);
        }
        CMD_READ if u32::from_be_bytes(len.try_into().expect("4")) <= MAX_SIMPLE_READ => {
            // Without structured replies a read carries its zeroes (the density
            // benchmark's idle clients read once so).
            let n = u32::from_be_bytes(len.try_into().expect("4")) as usize;
            out.extend_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
            out.extend_from_slice(&0u32.to_be_bytes());
            out.extend_from_slice(handle);
            out.resize(out.len() + n, 0);
        }
        _ => {
            // Everything else is refused (the benchmark's clients only read).
            out.extend_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
            out.extend_from_slice(&EINVAL.to_be_bytes());
            out.extend_from_slice(handle);
        }
    }
    Ok(true)
}

/// Requests until the client leaves: each receive goes through the ring (the thread sleeps
/// in io_uring_enter until it completes), each batch of replies out in one write.
fn transmission(conn: &UnixStream, structured: bool) -> io::Result<()> {
    let _ = stord_aio::sys::set_sched_slice(stord_aio::DEFAULT_SCHED_SLICE_NS);
    let mut ring = ring()?;
    let mut buf = vec![0u8; 64 << 10];
    let (mut start, mut end) = (0, 0);
    let mut out = Vec::with_capacity(4096);
    loop {
        while end - start >= 28 {
            if !answer(&buf[start..start + 28], structured, &mut out)? {
                return Ok(());
            }
            start += 28;
        }
        if !out.is_empty() {
            (&mut &*conn).write_all(&out)?;
            out.clear();
        }
        buf.copy_within(start..end, 0);
        end -= start;
        start = 0;
        let room = &mut buf[end..];
        let recv = opcode::Recv::new(
            types::Fd(conn.as_raw_fd()),
            room.as_mut_ptr(),
            room.len() as u32,
        )
        .build();
        // SAFETY: `room` lives until the completion is reaped below, before this loop
        // touches `buf` again.
        unsafe { ring.submission().push(&recv) }.expect("an empty ring has room");
        let cqe = loop {
            match ring.submit_and_wait(1) {
                Err(e) if e.kind() != io::ErrorKind::Interrupted => return Err(e),
                _ => {}
            }
            if let Some(cqe) = ring.completion().next() {
                break cqe;
            }
        };
        match cqe.result() {
            n if n > 0 => end += n as usize,
            0 => return Ok(()),
            e => return Err(io::Error::from_raw_os_error(-e)),
        }
    }
}
