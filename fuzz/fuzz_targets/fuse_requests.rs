//! FUSE requests as the kernel sends them, through the real request handler.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    stord::export::fuse::fuzz::requests(data);
});
