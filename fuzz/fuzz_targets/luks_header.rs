//! A LUKS header: decoded, encoded back, checked and parsed as an open does, and
//! unlocked against the rest of the input where its iteration counts are small.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    stord::crypto::fuzz::fuzz_header(data);
});
