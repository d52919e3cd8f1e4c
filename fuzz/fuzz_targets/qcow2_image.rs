//! A whole small qcow2 image (header, tables, data) opened read-write, then a few guest
//! reads, writes, write-zeroes, discards and flushes: errors are fine, a crash, a hang or a
//! write over the header is not.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    stord::block::drivers::qcow2::fuzz::fuzz_image(data);
});
