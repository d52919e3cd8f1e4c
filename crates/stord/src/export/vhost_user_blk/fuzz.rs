//! Entry point for the `vhost_user_messages` fuzz target (`fuzz/`): the real vhost-user
//! control loop fed a frontend's messages over a socket pair (fds attached where a message
//! takes them). (The descriptor-chain fuzzer is the device's: `virtio_blk::fuzz`.)
//!
//! Not part of the API: hidden from the docs, used by `fuzz/fuzz_targets/vhost_user_messages.rs`
//! and by the seed-replay test below.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, OnceLock};

use stord_aio::{AioContextOptions, IoThread, Remote};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use super::connection;
use crate::export::virtio_blk::fuzz::device;

/// Messages that carry fds (vhost-user's numbering): SET_MEM_TABLE, SET_LOG_BASE,
/// SET_LOG_FD, SET_VRING_KICK, SET_VRING_CALL, SET_VRING_ERR, SET_BACKEND_REQ_FD,
/// SET_INFLIGHT_FD, ADD_MEM_REG.
const TAKES_FDS: &[u32] = &[5, 6, 7, 12, 13, 14, 21, 32, 37];

/// The IoThread the fuzzed frontends' queues run on (one for the process).
fn remote() -> Remote {
    static THREAD: OnceLock<Remote> = OnceLock::new();
    THREAD
        .get_or_init(|| {
            let t = IoThread::spawn(AioContextOptions {
                name: "fuzz-vring".into(),
                ..Default::default()
            })
            .expect("iothread");
            let r = t.remote().clone();
            // Runs for the whole process.
            std::mem::forget(t);
            r
        })
        .clone()
}

/// The fds a message gets: a 64 KiB memfd for memory-like ones, an eventfd for the rest.
fn fds_for(request: u32, n_regions: usize) -> Vec<OwnedFd> {
    let memfd = || -> OwnedFd {
        let f = crate::sys::memfd_create("fuzz-guest").expect("memfd");
        f.set_len(64 << 10).expect("memfd size");
        f.into()
    };
    match request {
        5 => (0..n_regions.clamp(1, 8)).map(|_| memfd()).collect(),
        6 | 32 | 37 => vec![memfd()],
        _ => vec![stord_aio::sys::eventfd().expect("eventfd")],
    }
}

/// Sends `input` as a sequence of vhost-user messages (each header's size, cut to what is
/// left) to the real control loop, then hangs up; returns when the loop has ended.
pub fn messages(input: &[u8]) {
    let (ours, theirs) = UnixStream::pair().expect("socketpair");
    let dev = device();
    let channel = Arc::default();
    let server =
        std::thread::spawn(move || connection::serve(theirs, dev, channel, vec![remote()]));
    let mut rest = input;
    while !rest.is_empty() {
        let take = if rest.len() < 12 {
            rest.len()
        } else {
            let size = u32::from_le_bytes(rest[8..12].try_into().expect("4 bytes")) as usize;
            12 + size.min(rest.len() - 12)
        };
        let (msg, tail) = rest.split_at(take);
        rest = tail;
        let request = msg
            .get(..4)
            .map_or(0, |b| u32::from_le_bytes(b.try_into().expect("4 bytes")));
        // SET_MEM_TABLE: one fd per region (its count is the body's first u32).
        let regions = msg.get(12..16).map_or(1, |b| {
            u32::from_le_bytes(b.try_into().expect("4 bytes")) as usize
        });
        let fds = if TAKES_FDS.contains(&request) {
            fds_for(request, regions)
        } else {
            Vec::new()
        };
        let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
        if ours.send_with_fds(&[msg], &raw).is_err() {
            break;
        }
    }
    let _ = ours.shutdown(std::net::Shutdown::Write);
    // Replies are read and dropped so the loop never blocks on a full socket.
    let drain = {
        let ours = ours.try_clone().expect("clone");
        std::thread::spawn(move || {
            use std::io::Read;
            let mut buf = [0u8; 4096];
            let mut s = &ours;
            while matches!(s.read(&mut buf), Ok(n) if n > 0) {}
        })
    };
    server.join().expect("control loop panicked");
    let _ = ours.shutdown(std::net::Shutdown::Both);
    drain.join().expect("drain");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(request: u32, body: &[u8]) -> Vec<u8> {
        let mut v = request.to_le_bytes().to_vec();
        v.extend_from_slice(&1u32.to_le_bytes()); // version 1
        v.extend_from_slice(&(body.len() as u32).to_le_bytes());
        v.extend_from_slice(body);
        v
    }

    #[test]
    fn a_frontend_session_and_garbage_end_cleanly() {
        let mut input = msg(1, &[]); // GET_FEATURES
        input.extend(msg(3, &[])); // SET_OWNER
                                   // SET_MEM_TABLE: one region of 64 KiB at GPA 0 from the memfd.
        let mut body = 1u32.to_le_bytes().to_vec();
        body.extend_from_slice(&0u32.to_le_bytes());
        for v in [0u64, 64 << 10, 0x7000_0000, 0] {
            body.extend_from_slice(&v.to_le_bytes());
        }
        input.extend(msg(5, &body));
        // SET_VRING_NUM 0 = 8, then a bogus region count.
        let mut num = 0u32.to_le_bytes().to_vec();
        num.extend_from_slice(&8u32.to_le_bytes());
        input.extend(msg(8, &num));
        input.extend(msg(5, &u32::MAX.to_le_bytes()));
        messages(&input);
        messages(b"\xff\xff\xff\xff garbage");
        messages(&[]);
    }
}
