//! Entry points for the fuzz targets (`fuzz/`): the real vhost-user control loop fed a
//! frontend's messages over a socket pair (fds attached where a message takes them), and a
//! virtio-blk descriptor chain walked and executed over fuzzed guest memory.
//!
//! Not part of the API: hidden from the docs, used by `fuzz/fuzz_targets/vhost_*.rs` and by
//! the seed-replay tests below.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, OnceLock};

use stord_aio::{AioContextOptions, IoThread, Remote};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use super::device::BlkDevice;
use crate::block::drivers::null::NullDriver;
use crate::block::node::block_node::BlockNode;

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

/// A 1 MiB writable null disk with one queue.
fn device() -> Arc<BlkDevice> {
    let node = Arc::new(BlockNode::new(
        "disk".into(),
        Box::new(NullDriver::new(1 << 20, true)),
        false,
        false,
    ));
    Arc::new(BlkDevice::new("fuzz".into(), node, true, 512, 1))
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
    let server = std::thread::spawn(move || super::serve(theirs, dev, vec![remote()]));
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

/// Guest memory of two 32 KiB regions with a hole between them (0..32K and 48K..80K):
/// chains that cross a region's end, point into the hole or past memory are all possible.
const REGIONS: [(u64, usize); 2] = [(0, 32 << 10), (48 << 10, 32 << 10)];

/// `input`: head index (2 bytes), table size (2 bytes), table address (4 bytes), then guest
/// memory contents. The chain at `head` is walked as a queue does and, if well formed,
/// executed against a 1 MiB null disk; the status byte lands in guest memory.
pub fn chain(input: &[u8]) {
    if input.len() < 8 {
        return;
    }
    let head = u16::from_le_bytes([input[0], input[1]]);
    let size = u16::from_le_bytes([input[2], input[3]]).max(1);
    let table = u64::from(u32::from_le_bytes(input[4..8].try_into().expect("4 bytes")));
    let contents = &input[8..];
    let mem = Arc::new(
        GuestMemoryMmap::<()>::from_ranges(
            &REGIONS
                .iter()
                .map(|&(a, l)| (GuestAddress(a), l))
                .collect::<Vec<_>>(),
        )
        .expect("guest memory"),
    );
    let mut at = 0;
    for &(addr, len) in &REGIONS {
        let n = len.min(contents.len().saturating_sub(at));
        if n > 0 {
            mem.write_slice(&contents[at..at + n], GuestAddress(addr))
                .expect("in the region");
        }
        at += n;
    }
    let Ok(chain) = super::vring::walk_chain(&mem, GuestAddress(table), size, head) else {
        return;
    };
    let writable: u64 = chain.inn.iter().map(|s| u64::from(s.len)).sum();
    let dev = device();
    let used = crate::export::fuzz_loop::with_loop(|ctx| {
        ctx.block_on(async move { super::request::execute(&dev, &mem, &chain).await })
    });
    // The used length never claims more than the device-writable part.
    assert!(u64::from(used) <= writable, "used {used} of {writable}");
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

    #[test]
    fn chains_in_and_out_of_memory() {
        // A read of 512 bytes: header at 0x1000, data at 0x2000, status at 0x3000.
        let mut mem = vec![0u8; 64 << 10];
        let put = |mem: &mut Vec<u8>, i: usize, addr: u64, len: u32, flags: u16, next: u16| {
            let at = 0x100 + 16 * i;
            mem[at..at + 8].copy_from_slice(&addr.to_le_bytes());
            mem[at + 8..at + 12].copy_from_slice(&len.to_le_bytes());
            mem[at + 12..at + 14].copy_from_slice(&flags.to_le_bytes());
            mem[at + 14..at + 16].copy_from_slice(&next.to_le_bytes());
        };
        put(&mut mem, 0, 0x1000, 16, 1, 1);
        put(&mut mem, 1, 0x2000, 512, 1 | 2, 2);
        put(&mut mem, 2, 0x3000, 1, 2, 0);
        // Descriptor 3: data in the hole between the regions.
        put(&mut mem, 3, 0x1000, 16, 1, 4);
        put(&mut mem, 4, 0x9000, 512, 1 | 2, 2);
        for head in [0u16, 3] {
            let mut input = head.to_le_bytes().to_vec();
            input.extend_from_slice(&8u16.to_le_bytes());
            input.extend_from_slice(&0x100u32.to_le_bytes());
            input.extend_from_slice(&mem);
            chain(&input);
        }
        chain(&[0; 8]);
        // Found by the fuzzer: a status segment that wraps past the top of the address
        // space (addr + len overflowed).
        put(&mut mem, 5, 0x1000, 16, 1, 6);
        put(&mut mem, 6, u64::MAX - 4, 512, 2, 0);
        // And an indirect table at the top of the address space.
        put(&mut mem, 7, u64::MAX - 15, 32, 4, 0);
        for head in [5u16, 7] {
            let mut input = head.to_le_bytes().to_vec();
            input.extend_from_slice(&8u16.to_le_bytes());
            input.extend_from_slice(&0x100u32.to_le_bytes());
            input.extend_from_slice(&mem);
            chain(&input);
        }
    }
}
