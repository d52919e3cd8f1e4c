//! A virtio-blk descriptor chain (direct or indirect) walked over fuzzed guest memory with
//! a hole, and executed against a null disk.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    stord::export::virtio_blk::fuzz::chain(data);
});
