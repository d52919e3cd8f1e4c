//! A qcow2 header with its extensions, then L2 entries and refcount blocks decoded with the
//! header's geometry.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    stord::block::drivers::qcow2::fuzz(data);
});
