//! Fuzz entry (`fuzz/fuzz_targets/luks_header.rs`): a LUKS header's bytes, decoded,
//! encoded back, checked and parsed as an open does, then, where its iteration counts
//! are small enough to run, unlocked with a fixed password against the rest of the input
//! as the volume. Whatever the header says must end in an error, never a crash or a
//! read outside the volume.

use super::luks::header::{LuksHeader, HEADER_LEN};
use super::luks::Luks;
use super::CryptoError;

/// Iteration counts past this are not run (they would only slow the fuzzer down).
const MAX_ITERS: u32 = 10_000;

/// The password the seeds were made with.
pub const PASSWORD: &[u8] = b"fuzz";

/// Returns whether the volume unlocked (the seeds' does).
pub fn fuzz_header(data: &[u8]) -> bool {
    let mut bytes = [0u8; HEADER_LEN];
    let n = data.len().min(HEADER_LEN);
    bytes[..n].copy_from_slice(&data[..n]);
    let decoded = LuksHeader::decode(&bytes);
    assert!(decoded.encode() == bytes, "encode undoes decode");
    for detached in [false, true] {
        let Ok(luks) = Luks::load(&bytes, detached) else {
            continue;
        };
        let h = &luks.header;
        let cheap = h.master_key_iterations <= MAX_ITERS
            && h.key_slots
                .iter()
                .all(|s| !s.is_active() || s.iterations <= MAX_ITERS);
        if !cheap {
            continue;
        }
        let mut read = |offset: u64, buf: &mut [u8]| {
            let start = usize::try_from(offset).unwrap_or(usize::MAX);
            let src = data
                .get(start..)
                .and_then(|d| d.get(..buf.len()))
                .ok_or_else(|| CryptoError::Io("past the end".into()))?;
            buf.copy_from_slice(src);
            Ok(())
        };
        if let Ok(key) = luks.find_key(PASSWORD, &mut read) {
            let mut sector = [0u8; 512];
            let c = luks.cipher(&key).expect("an unlocked volume has a cipher");
            c.encrypt(0, &mut sector).expect("a sector encrypts");
            return true;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    #[test]
    fn short_and_garbage_inputs_end_in_errors() {
        assert!(!super::fuzz_header(b""));
        assert!(!super::fuzz_header(b"LUKS\xba\xbe\x00\x01aes"));
        assert!(!super::fuzz_header(&[0xff; 700]));
    }

    #[test]
    fn the_committed_seed_unlocks() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../fuzz/corpus/luks_header");
        let mut unlocked = 0;
        // Only the committed seeds: a local fuzz run adds inputs of its own beside them
        // (ignored by git), and one of those may unlock too.
        for e in std::fs::read_dir(dir).unwrap() {
            let path = e.unwrap().path();
            let seed = path
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("seed-"));
            if seed {
                let data = std::fs::read(&path).unwrap();
                unlocked += usize::from(super::fuzz_header(&data));
            }
        }
        assert_eq!(
            unlocked, 1,
            "the AES-128-CBC seed carries slot 0's material"
        );
    }
}
