//! Crash rounds for the kill -9 tests: batches of random 4 KiB writes, each batch flushed,
//! the last one still in flight when the daemon is killed. Each block written holds its
//! write's id in every 8-byte word, so a test can tell old from new from torn.

use std::time::Duration;

use super::rawnbd::{RawNbd, CMD_FLUSH, CMD_WRITE};
use super::Stord;

/// Bytes per write.
pub const BLOCK: u64 = 4096;

/// A tiny xorshift generator (no crate needed for test offsets).
pub struct Rng(pub u64);

impl Rng {
    /// Seeded from the clock; the seed is printed so a failure can be replayed.
    pub fn from_clock() -> Rng {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64
            | 1;
        eprintln!("seed {seed}");
        Rng(seed)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Writes as (offset, id).
pub type Writes = Vec<(u64, u64)>;

/// The block write `id` writes: the id in every word.
pub fn block_of(id: u64) -> Vec<u8> {
    std::iter::repeat_n(id.to_le_bytes(), (BLOCK / 8) as usize)
        .flatten()
        .collect()
}

/// One round against `s`'s export `disk` (a disk of `size` bytes): 2 to 9 batches of 8
/// writes to distinct random blocks, each acknowledged and flushed, then one more batch
/// sent and `s` killed with SIGKILL after up to 2 ms. Write ids continue from `*id`.
/// Returns the flushed writes (offset, id), in order, and the batch in flight.
pub fn flushed_writes_then_kill(
    s: &mut Stord,
    rng: &mut Rng,
    size: u64,
    id: &mut u64,
) -> (Writes, Writes) {
    let mut c = RawNbd::connect(&s.sock, "disk");
    let batches = 2 + rng.next() % 8;
    let mut flushed = Vec::new();
    for b in 0..=batches {
        let mut batch: Writes = Vec::new();
        while batch.len() < 8 {
            let off = rng.next() % (size / BLOCK) * BLOCK;
            if batch.iter().all(|&(o, _)| o != off) {
                *id += 1;
                batch.push((off, *id));
            }
        }
        for &(off, id) in &batch {
            c.send_request(CMD_WRITE, 0, id, off, BLOCK as u32, &block_of(id));
        }
        if b == batches {
            std::thread::sleep(Duration::from_micros(rng.next() % 2000));
            s.kill9();
            return (flushed, batch);
        }
        for _ in 0..8 {
            assert_eq!(c.read_reply(0).0, 0, "write failed");
        }
        c.send_request(CMD_FLUSH, 0, 0, 0, 0, &[]);
        assert_eq!(c.read_reply(0).0, 0, "flush failed");
        flushed.extend(batch);
    }
    unreachable!("the last batch returns")
}
