//! The NBD option haggling (fixed newstyle) on whatever a client sends.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    stord::export::nbd::fuzz::handshake(data);
});
