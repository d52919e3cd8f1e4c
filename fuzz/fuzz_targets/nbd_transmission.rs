//! NBD requests (headers, write payloads, every command) on a negotiated connection to a
//! 1 MiB null disk; the first byte picks simple or structured replies.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    stord::export::nbd::fuzz::transmission(data);
});
