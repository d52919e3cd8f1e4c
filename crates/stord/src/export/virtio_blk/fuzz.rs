//! Entry point for the `virtio_blk_chain` fuzz target (`fuzz/`): a virtio-blk descriptor
//! chain walked and executed over fuzzed guest memory, as a queue would take it off its
//! ring, whichever transport drives the device.
//!
//! Not part of the API: hidden from the docs, used by `fuzz/fuzz_targets/virtio_blk_chain.rs`,
//! the seed-replay test below and the vhost-user messages fuzzer (its disk).

use std::sync::Arc;

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::device::BlkDevice;
use crate::block::drivers::null::NullDriver;
use crate::block::node::block_node::BlockNode;

/// A 1 MiB writable null disk with one queue.
pub fn device() -> Arc<BlkDevice> {
    let node = Arc::new(BlockNode::new(
        "disk".into(),
        Box::new(NullDriver::new(1 << 20, true)),
        false,
        false,
    ));
    Arc::new(BlkDevice::new("fuzz".into(), node, true, 512, 1))
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
    let Ok(chain) = super::chain::walk_chain(&mem, GuestAddress(table), size, head) else {
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
