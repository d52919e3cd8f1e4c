//! Entry point for the FUSE fuzz target (`fuzz/fuzz_targets/fuse_requests.rs`): requests as
//! the kernel would send them, through the real request handler ([`FuseShared::process`])
//! of a writable export of a 1 MiB null disk. No mount: the handler does not touch
//! /dev/fuse. Not part of the API.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize};
use std::sync::{Arc, Mutex};

use super::shared::{FuseShared, MAX_WRITE};
use crate::block::drivers::null::NullDriver;
use crate::block::node::block_node::BlockNode;
use crate::export::DrainSignal;

fn shared() -> FuseShared {
    let node = Arc::new(BlockNode::new(
        "disk".into(),
        Box::new(NullDriver::new(1 << 20, true)),
        false,
        false,
    ));
    FuseShared {
        link: crate::block::node::link::NodeLink::new(node),
        writable: true,
        writethrough: false,
        growable: false,
        allow_other: false,
        mode: AtomicU32::new(0o100600),
        uid: 0,
        gid: 0,
        max_write: MAX_WRITE,
        in_flight: AtomicUsize::new(0),
        drain: DrainSignal::default(),
        halted: AtomicBool::new(false),
        initialized: AtomicBool::new(false),
        want_uring: false,
        uring_granted: AtomicBool::new(false),
        uring_plan: Mutex::new(None),
        rings: Mutex::default(),
        dev_requests: Default::default(),
        uring_requests: Default::default(),
    }
}

/// Splits `input` into requests by their header's length (cut to what is left) and has the
/// handler process each in turn, until it halts the channel.
pub fn requests(input: &[u8]) {
    let s = shared();
    let input = input.to_vec();
    crate::export::fuzz_loop::with_loop(|ctx| {
        ctx.block_on(async move {
            let mut rest = &input[..];
            while !rest.is_empty() {
                let len = rest.get(..4).map_or(rest.len(), |b| {
                    u32::from_le_bytes(b.try_into().expect("4")) as usize
                });
                let take = len.clamp(1, rest.len());
                let (msg, tail) = rest.split_at(take);
                rest = tail;
                let _ = s.process(msg).await;
                if s.halted.load(std::sync::atomic::Ordering::SeqCst) {
                    break;
                }
            }
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(opcode: u32, unique: u64, body: &[u8]) -> Vec<u8> {
        let len = (40 + body.len()) as u32;
        let mut v = len.to_le_bytes().to_vec();
        v.extend_from_slice(&opcode.to_le_bytes());
        v.extend_from_slice(&unique.to_le_bytes());
        v.extend_from_slice(&1u64.to_le_bytes()); // nodeid
        v.extend_from_slice(&[0u8; 16]); // uid, gid, pid, padding
        v.extend_from_slice(body);
        v
    }

    #[test]
    fn init_getattr_read_write_and_garbage() {
        let mut init = 7u32.to_le_bytes().to_vec(); // major
        init.extend_from_slice(&31u32.to_le_bytes()); // minor
        init.extend_from_slice(&[0u8; 56]);
        let mut input = req(26, 1, &init); // INIT
        input.extend(req(3, 2, &[0u8; 16])); // GETATTR
        let mut read = 0u64.to_le_bytes().to_vec(); // fh
        read.extend_from_slice(&4096u64.to_le_bytes()); // offset
        read.extend_from_slice(&4096u32.to_le_bytes()); // size
        read.extend_from_slice(&[0u8; 20]);
        input.extend(req(15, 3, &read)); // READ
        let mut write = 0u64.to_le_bytes().to_vec();
        write.extend_from_slice(&(1u64 << 40).to_le_bytes()); // past the end
        write.extend_from_slice(&512u32.to_le_bytes());
        write.extend_from_slice(&[0u8; 20]);
        write.extend_from_slice(&[0xab; 512]);
        input.extend(req(16, 4, &write)); // WRITE
        requests(&input);
        requests(&[0xff; 7]);
        requests(&[]);
    }
}
